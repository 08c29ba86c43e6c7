"""stepserve loadgen package."""
