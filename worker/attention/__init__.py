"""Paged attention: per-step metadata, the backends (C++ on CPU, flash-attn, torch) and
the registry that picks one."""
