"""Data model, prompt sources and prompt encoding."""
