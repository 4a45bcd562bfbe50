"""Engines behind one interface, built by the factory."""
