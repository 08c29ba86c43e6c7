"""stepserve service package."""
