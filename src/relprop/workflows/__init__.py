"""Workflows on top of the methods: datasets explained to disk, concepts, evaluation, the MNIST demo model."""
