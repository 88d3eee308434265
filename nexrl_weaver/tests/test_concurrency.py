"""Sixteen nex-weaver SDK clients at once on one Weaver service (`ClientsAtOnceContract`)."""

from __future__ import annotations

from weaver.types import AdamParams, Datum, ModelInput, SamplingParams

from nexrl_service.testing import CLIENT_STEPS, ClientsAtOnceContract
from nexrl_weaver.testing import sdk_client, start_service


class TestSixteenClientsAtOnce(ClientsAtOnceContract):
    start_service = staticmethod(start_service)

    def one_client(self, base_url: str, index: int) -> tuple[list[float], list[int], str]:
        tokens = [(index * 7 + j) % 50 + 3 for j in range(12)]
        datum = Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11})
        client = sdk_client(base_url)
        client.connect()
        try:
            model = client.create_model(base_model="nexrl-tiny", training_mode="full_ft")
            counters = []
            for _ in range(CLIENT_STEPS):
                model.forward_backward([datum], "cross_entropy")
                counters.append(model.optim_step(AdamParams(learning_rate=1e-3))["metrics"]["step"])
            sampler = model.save_weights_and_get_sampling_client(name=f"c{index}")
            sample = sampler.sample(prompt=ModelInput.from_ints(tokens[:4]), sampling_params=SamplingParams(max_tokens=3, seed=index))
            return counters, list(sample["sequences"][0]["tokens"]), model.model_id
        finally:
            client.close()
