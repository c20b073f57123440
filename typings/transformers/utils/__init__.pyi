from collections import OrderedDict
from typing import Any

class ModelOutput(OrderedDict[str, Any]):
    def __getitem__(self, k: str | int) -> Any: ...
