"""``edge-spec chat`` on a terminal: the line editor and its history (:mod:`.terminal`), the commands
answered locally (:mod:`.commands`), the conversation loop (:mod:`.loop`), Ctrl-C during an answer
(:mod:`.interrupt`) and the rendering of a streamed answer (:mod:`.render`)."""
