"""Serving engine: block manager, scheduler and the step loop."""
