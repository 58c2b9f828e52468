"""A desktop chat window (PySide6) that runs an edge-spec bundle in its own process: the engine decodes
in a worker thread and the window shows the answer as it streams, each token coloured by where it came
from (the target, the drafter model, text copied from earlier answers, ...), as the chat page does."""
