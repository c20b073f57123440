# transformers.generation.streamers, as checked against 5.17.0, 5.24.0 and 5.25.0 (tests/test_stubs.py): the two
# calls `generate` makes on a streamer, which transformers leaves unannotated.
import torch

class BaseStreamer:
    def put(self, value: torch.Tensor) -> None: ...
    def end(self) -> None: ...
