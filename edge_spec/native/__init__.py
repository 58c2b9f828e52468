"""Native kernels that ORT's own CPU ops lack, built from source at first use (``build``): a
``GroupQueryAttention`` that reads each key/value head once per pass and keeps each query row's result
independent of the rows beside it (``attention.cc``)."""
