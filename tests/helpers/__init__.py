"""Test helpers shared by several test directories."""
