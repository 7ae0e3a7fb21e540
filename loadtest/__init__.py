"""Locust load test of the embedding service: SLA gate, per-stage report, capacity search (see README.md)."""
