"""Tools that write files from the code (docs/configs.md)."""
