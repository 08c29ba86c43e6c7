"""The benchmark scripts, each a module run from the repository root as `python -m bench.NAME`
(printing JSON); `bench.servers` holds what they share."""
