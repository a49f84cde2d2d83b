"""The collective runtime every backend and adapter builds on."""
