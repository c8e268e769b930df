"""The shared kernel every exitplane process stands on: JSON logs and request ids (`logs`),
OpenTelemetry tracing (`tracing`), build info and process metrics (`build`), liveness
promises (`liveness`) and the `Authorization: Bearer` parser (`bearer`). It imports nothing
of the control plane, the runtime or the CLI."""
