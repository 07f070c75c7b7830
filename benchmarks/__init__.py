"""make bench: every engine side by side in one run, against the machine's own limits."""
