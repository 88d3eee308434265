"""Sixteen tinker SDK clients at once on one service (`ClientsAtOnceContract`)."""

from __future__ import annotations

import tinker
from tinker import types

from nexrl_service.testing import CLIENT_STEPS, ClientsAtOnceContract
from nexrl_tinker.testing import BASE_MODEL, start_service


class TestSixteenClientsAtOnce(ClientsAtOnceContract):
    start_service = staticmethod(start_service)

    def one_client(self, base_url: str, index: int) -> tuple[list[float], list[int], str]:
        tokens = [(index * 7 + j) % 50 + 3 for j in range(12)]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        with tinker.ServiceClient(base_url=base_url) as client:
            training = client.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=index).result(timeout=300)
            counters = []
            for _ in range(CLIENT_STEPS):
                training.forward_backward([datum], "cross_entropy").result(timeout=300)
                metrics = training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300).metrics
                counters.append(metrics["step:mean"])
            sample = (
                training.save_weights_and_get_sampling_client()
                .result(timeout=300)
                .sample(
                    types.ModelInput.from_ints(tokens[:4]), num_samples=1, sampling_params=types.SamplingParams(max_tokens=3, seed=index)
                )
                .result(timeout=300)
            )
            return counters, list(sample.sequences[0].tokens), training.model_id
