"""A bundle made and put in place: the export itself (``build``), what it builds and its defaults
(``options``), its timed and memory-checked steps (``stages``) run in a watched child process
(``watchdog``) that reports what it is doing (``activity``), and the finished directory installed
atomically (``install``)."""
