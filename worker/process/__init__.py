"""The worker process and its plumbing: the process's main loop, the engine's asyncio
client, the messages between them and the helper threads' CPU scheduling."""
