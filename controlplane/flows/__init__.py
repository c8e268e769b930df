"""Flows that span domains: recalibration, the automatic fallback and canary rollouts, and the
calibration routes that set them off (`api.py`). They sit above the domains they orchestrate;
no domain imports them (the fallback answers alerts through `alerts.reactions`)."""
