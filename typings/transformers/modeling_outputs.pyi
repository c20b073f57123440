# transformers.modeling_outputs, as checked against 5.17.0, 5.23.0, 5.24.0 and 5.25.0.
import torch
from transformers.utils import ModelOutput

class BaseModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None
    def __init__(self, last_hidden_state: torch.Tensor | None = None) -> None: ...
