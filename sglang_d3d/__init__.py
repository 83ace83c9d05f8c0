"""D3D speculative decoding: engine, SGLang worker, drafter training (see docs/design.md)."""
