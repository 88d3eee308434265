"""Protobuf decoding and encoding edge cases, with the SDK's own schema and decoders."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from nexrl_service.errors import BadRequest
from nexrl_tinker.server.codec import (
    TopkRows,
    decode_forward_backward,
    decode_forward_backward_json,
    decode_target_prompt_ids,
    decompress_body,
    encode_forward_backward_output,
    encode_sample_response,
)
from nexrl_tinker.server.training import normalise_metrics


def request_with(tensor: pb.Tensor, tokens: tuple[int, ...] = (1, 2, 3)) -> bytes:
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(tensor)
    message.loss_fn_config["clip_low_threshold"] = 0.8
    message.loss_fn_config_v2["agg_mode"].text = "token-sum"
    return message.SerializeToString()


def test_dense_and_config() -> None:
    tensor = pb.Tensor(dtype=pb.DTYPE_INT64, dense=np.asarray([5, 6, 7], dtype=np.int64).tobytes(), shape=[3])
    decoded = decode_forward_backward(request_with(tensor))
    assert decoded.data[0].tokens.tolist() == [1, 2, 3]
    assert decoded.data[0].inputs["target_tokens"].tolist() == [5, 6, 7]
    assert decoded.loss_fn_config == {"clip_low_threshold": 0.8, "agg_mode": "token-sum"}


def test_sparse_csr_and_bfloat16() -> None:
    csr = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[3, 2])
    csr.sparse_csr.values = np.asarray([4, 9], dtype=np.int64).tobytes()
    csr.sparse_csr.crow_indices = np.asarray([0, 1, 1, 2], dtype=np.int64).tobytes()
    csr.sparse_csr.col_indices = np.asarray([0, 1], dtype=np.int64).tobytes()
    dense = decode_forward_backward(request_with(csr)).data[0].inputs["target_tokens"]
    assert dense.tolist() == [[4, 0], [0, 0], [0, 9]]
    values = np.asarray([1.5, -2.0, 0.25], dtype=np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)
    tensor = pb.Tensor(dtype=pb.DTYPE_BFLOAT16, dense=bf16.tobytes())
    assert decode_forward_backward(request_with(tensor)).data[0].inputs["target_tokens"].tolist() == [1.5, -2.0, 0.25]


@pytest.mark.parametrize(
    "tensor, message",
    [
        (pb.Tensor(dtype=pb.DTYPE_INT64, dense=b"\x00" * 12), "not a multiple of 8"),
        (pb.Tensor(dtype=pb.DTYPE_INT64, dense=b"\x00" * 16, shape=[3]), "needs 3 values"),
        (pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, dense=b""), "unsupported tensor dtype"),
    ],
)
def test_bad_tensors(tensor: pb.Tensor, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        decode_forward_backward(request_with(tensor))


def test_bad_csr_indices() -> None:
    csr = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2, 2])
    csr.sparse_csr.values = np.asarray([4], dtype=np.int64).tobytes()
    csr.sparse_csr.crow_indices = np.asarray([0, 1, 1], dtype=np.int64).tobytes()
    csr.sparse_csr.col_indices = np.asarray([5], dtype=np.int64).tobytes()
    with pytest.raises(BadRequest, match="column index out of range"):
        decode_forward_backward(request_with(csr))


def test_image_chunks_are_refused() -> None:
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    message.data.add().model_input.add().image.data = b"png"
    with pytest.raises(BadRequest, match="text-only"):
        decode_forward_backward(message.SerializeToString())


def test_zstd() -> None:
    import zstandard

    body = request_with(pb.Tensor(dtype=pb.DTYPE_INT64, dense=np.zeros(3, dtype=np.int64).tobytes()))
    compressed = zstandard.ZstdCompressor().compress(body)
    assert decompress_body(compressed, "zstd", 1 << 20) == body
    with pytest.raises(BadRequest, match="larger than"):
        decompress_body(compressed, "zstd", 10)
    with pytest.raises(BadRequest, match="Content-Encoding"):
        decompress_body(body, "br", 1 << 20)


def test_json_form() -> None:
    body = {
        "model_id": "m",
        "seq_id": 2,
        "forward_backward_input": {
            "loss_fn": "cross_entropy",
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                    "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64"}},
                }
            ],
        },
    }
    decoded = decode_forward_backward_json(body)
    assert decoded.seq_id == 2 and decoded.data[0].inputs["target_tokens"].tolist() == [2, 3]


@pytest.mark.parametrize("model_input", [None, [], [{"type": "encoded_text", "tokens": [1]}], {"chunks": "1 2"}, "1 2"])
def test_a_datum_whose_model_input_is_not_an_object_with_chunks_is_refused_by_name(model_input: Any) -> None:
    """Whatever a JSON body puts in ``model_input`` (fuzzing once sent a list), the answer is
    a 400 naming it, never a server error."""
    body = {"model_id": "m", "seq_id": 1, "forward_backward_input": {"loss_fn": "cross_entropy", "data": [{"model_input": model_input}]}}
    with pytest.raises(BadRequest, match="datum 0: model_input must be an object whose chunks are a list"):
        decode_forward_backward_json(body)


def test_outputs_round_trip_through_the_sdk_decoders() -> None:
    outputs = [
        {"logprobs": np.asarray([-1.0, -2.0], dtype=np.float32)},
        {"logprobs": np.asarray([-3.0], dtype=np.float32)},
        {"logprobs": np.asarray([[-1.0, -2.0], [-3.0, -4.0]], dtype=np.float32)},
    ]
    decoded = deserialize_forward_backward_output(encode_forward_backward_output(outputs, {"loss:sum": 3.0}))
    assert decoded.metrics == {"loss:sum": 3.0}
    assert [o["logprobs"].shape for o in decoded.loss_fn_outputs] == [[2], [1], [2, 2]]
    assert decoded.loss_fn_outputs[2]["logprobs"].tolist() == [[-1.0, -2.0], [-3.0, -4.0]]
    sample = deserialize_sample_response(encode_sample_response([([5, 6], [-0.5, -0.25], "stop")], [None, -1.0, -2.0]))
    assert sample.sequences[0].tokens == [5, 6] and sample.sequences[0].stop_reason == "stop"
    assert sample.prompt_logprobs == [None, -1.0, -2.0]


def test_topk_matrices_and_target_tensors_read_back_through_the_sdk() -> None:
    """Empty top-k rows are the SDK's sentinel (read as None); a sparse target request's
    unlisted cells and a listed -1 ask for nothing, and the answer keeps its layout."""
    prompt_topk = TopkRows(length=3, k=2, first=2, token_ids=[[4, 9]], logprobs=[[-0.1, -2.5]])
    sample_topk = TopkRows(length=2, k=2, first=0, token_ids=[[5, 1], [6, 2]], logprobs=[[-0.5, -1.0], [-0.25, -3.0]])
    value = {"data": [-1, 4], "dtype": "int64", "shape": [2, 2], "sparse_crow_indices": [0, 1, 2], "sparse_col_indices": [1, 0]}
    targets = decode_target_prompt_ids(value, prompt_length=3, vocab_size=10, max_cells=100)
    assert targets.ids.tolist() == [[-1, -1], [4, -1]] and targets.cells() == ([2], [4])
    body = encode_sample_response(
        [([5, 6], [-0.5, -0.25], "length")],
        None,
        sequence_topk=[sample_topk],
        topk_prompt=prompt_topk,
        target_prompt_logprobs=targets.answer([-0.75]),
    )
    sample = deserialize_sample_response(body)
    assert sample.topk_prompt_logprobs == [None, None, [(4, pytest.approx(-0.1)), (9, -2.5)]]
    assert sample.sequences[0].topk_logprobs == [[(5, -0.5), (1, -1.0)], [(6, -0.25), (2, -3.0)]]
    answer = sample.target_prompt_logprobs
    assert answer is not None and answer.sparse_crow_indices == [0, 1, 2] and answer.sparse_col_indices == [1, 0]
    assert answer.to_torch().tolist() == [[0.0, 0.0], [-0.75, 0.0]]
    with pytest.raises(BadRequest, match="at most 3 per request"):
        decode_target_prompt_ids({**value, "shape": [2, 2]}, prompt_length=3, vocab_size=10, max_cells=3)


def test_metric_names_always_have_one_colon() -> None:
    assert normalise_metrics({"loss:sum": 1.0, "grad_norm": 2.0, "a:b:max": 3.0}) == {
        "loss:sum": 1.0,
        "grad_norm:mean": 2.0,
        "a_b:max": 3.0,
    }
