"""The codec: a state tree (nested containers of tensors and plain values) to wire values and back, without pickle.

The sender turns the caller's object into three things (:func:`.skeleton.encode_tree`):

* a *skeleton* (:mod:`.skeleton`): a msgpack-able mirror of the containers and
  plain leaves, in which each tensor is replaced by an index into the tensor table;
* a *tensor table* (:mod:`.tensors`): one entry per tensor (which storage, dtype,
  shape, stride, offset), so views and aliases survive the trip;
* the *storages*: each distinct storage once, as raw bytes that travel as frames.

The receiver validates the skeleton and the table before any tensor byte arrives
(:func:`.skeleton.index_skeleton`, :func:`.tensors.decode_tensor_table`), then
rebuilds the object (:func:`.skeleton.build_tree`). DTensor specs travel as plain
values too (:mod:`.dtensor`).

Imports run one way: :mod:`.dtypes` and :mod:`.keypaths` import nothing from the
package; :mod:`.tensors` and :mod:`.dtensor` import only those (and errors);
:mod:`.skeleton` imports them all. Nothing here imports sockets or threads.
"""
