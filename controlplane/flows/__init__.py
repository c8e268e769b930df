"""Flows that span domains: recalibration, the automatic fallback and canary rollouts."""
