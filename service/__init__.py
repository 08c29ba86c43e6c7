"""The service: the engine (scheduler and worker driven with overlap) and the HTTP layer
in front of it, plus the command line."""
