"""nexrl-testing: this repository's own test machinery, kept out of the published ``nexrl``.

Recipe-key recording across every process a test starts (`recipe_key_records`), a
throwaway PostgreSQL server (`postgres`), finding the processes and listeners a run left
(`processes`), a proxy that loses answers (`dropping_proxy`), seeded schema fuzzing of our
HTTP apps (`fuzz`), runs driven as a user drives them (`served_runs`), GPU detection
(`devices`), a chat model that records what it samples (`chat_models`) and the bounds
bfloat16 compute is held to on any CPU (`bf16_bounds`), with the pytest
plugin that wires them in (`pytest_plugin`). Plugin authors use the conformance kit in
``nexrl_core.testing`` instead; nothing here is for them.
"""

__version__ = "0.1.0"
