"""Adapters that drive real models' own distributed code paths (imported lazily)."""
