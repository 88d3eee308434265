"""Weaver for NexRL."""
