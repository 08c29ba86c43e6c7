"""The command line: `stepserve serve|bench|simulate|view`, the serve flags, and the server
process's lifetime."""
