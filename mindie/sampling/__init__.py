"""Per-step sampling over a batch of sequences (the C++ kernel does the work)."""
