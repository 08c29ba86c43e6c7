"""The engine: the asyncio loop that drives the scheduler and the worker with two plans in
flight, the output processor, detokenizer, bounded streams, metrics and step records."""
