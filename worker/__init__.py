"""stepserve worker package."""
