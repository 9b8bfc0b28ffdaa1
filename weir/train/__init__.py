"""Trainer side: model loading, packing, actor, SFT."""
