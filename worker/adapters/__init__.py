"""Per-request prompt adapters named in the worker's config (PredictRequest.adapter)."""
