"""The HTTP layer: the aiohttp app and its routes, OpenAI request and response shapes,
errors, server-sent events, the stall watch and the live view's routes."""
