"""OpenAI-compatible HTTP server for one loaded bundle (``edge-spec serve``).

One module per job: ``schemas`` turns request bodies into typed records, ``fim`` knows the model's
fill-in-the-middle tokens, ``tool_calls`` reads tool calls in the model's own format and ``tool_use``
decides what a request does with its tools, ``queue`` runs every generation on one worker thread in
arrival order, ``openai_format`` builds the response bodies and stream chunks, ``tokens`` answers
``/tokenize`` and ``/detokenize``, ``metrics`` counts for ``/metrics``, ``app`` holds the routes,
``serve`` runs them under uvicorn with graceful shutdown, ``defaults`` holds what it does when an option is
not given.  Starlette and uvicorn do all the HTTP.
"""
