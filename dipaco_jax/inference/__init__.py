"""Using trained models: export a path, generate text with routing."""
