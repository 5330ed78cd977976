"""Tracking maths that runs in the training workers: no MLflow, no Ray controller."""
