"""Recording a run while it trains: the Ray Train controller's callbacks, and the buffer
that keeps MLflow off their path."""
