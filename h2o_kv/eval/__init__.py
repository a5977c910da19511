"""Accuracy evaluation for bounded-KV-cache generation: synthetic retrieval tasks and text metrics."""
