"""Async requests and the queue that finalizes them in order on every rank."""
