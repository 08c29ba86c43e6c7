"""The worker: runs step plans on the model in its own process (model, kernels, attention,
plan execution, process plumbing)."""
