"""stepserve scheduler package."""
