"""The harness's Hydra launchers (Hydra takes launcher classes only from the hydra_plugins package)."""
