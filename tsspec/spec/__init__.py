"""The speculator side: algorithms (one file each), the shared loop, verification, the governor."""
