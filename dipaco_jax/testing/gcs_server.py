"""The GCS emulator's process, with what tensorstore and the store need of
GCS added to `gcp-storage-emulator` (`testing/gcs.py` says what and why):
generation headers on media reads, the `ifGenerationMatch` /
`ifGenerationNotMatch` preconditions, and a request log.

  python -m dipaco_jax.testing.gcs_server PORT     (cwd: the log's folder)

`testing.gcs.start` runs it; nothing else should.
"""

import json
import os
import sys
import time
import urllib.parse

from dipaco_jax.testing import gcs


def _object_generation(storage, bucket: str, name: str | None) -> int:
  """The live generation of an object, 0 when there is none."""
  from gcp_storage_emulator.exceptions import NotFound  # pylint: disable=g-import-not-at-top
  if not bucket or not name:
    return 0
  try:
    return int(storage.get_file_obj(bucket, name)["generation"])
  except NotFound:
    return 0


def _query_int(request, key: str) -> int | None:
  values = request.query.get(key)
  return int(values[0]) if values else None


def _upload_name(request) -> str | None:
  if request.query.get("name"):
    return request.query["name"][0]
  data = request.data
  meta = data.get("meta") if isinstance(data, dict) else None
  return meta.get("name") if isinstance(meta, dict) else None


def _path_name(request) -> str | None:
  return request.params.get("object_id")


def _with_preconditions(handler, object_name, reading: bool):
  """`handler` behind GCS's generation preconditions; a successful media
  read also reports the object's generation headers."""
  from http import HTTPStatus  # pylint: disable=g-import-not-at-top

  def wrapped(request, response, storage, *args, **kwargs):
    bucket = request.params.get("bucket_name")
    name = object_name(request)
    current = _object_generation(storage, bucket, name)
    match = _query_int(request, "ifGenerationMatch")
    not_match = _query_int(request, "ifGenerationNotMatch")
    if reading and not current:
      pass  # Missing: the handler answers 404.
    elif match is not None and match != current:
      response.status = HTTPStatus.PRECONDITION_FAILED
      response.json({"error": {"code": 412, "message": "ifGenerationMatch"}})
      return None
    elif not_match is not None and not_match == current:
      if reading:
        response.status = HTTPStatus.NOT_MODIFIED
      else:
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412,
                                 "message": "ifGenerationNotMatch"}})
      return None
    result = handler(request, response, storage, *args, **kwargs)
    if reading and response.status in (HTTPStatus.OK,
                                       HTTPStatus.PARTIAL_CONTENT):
      obj = storage.get_file_obj(bucket, name)
      response["x-goog-generation"] = str(obj["generation"])
      response["x-goog-metageneration"] = str(obj.get("metageneration", 1))
    return result

  return wrapped


def _patch_emulator() -> None:
  """Adds generation headers and preconditions to the emulator's media
  reads (`download`, also reached as `get?alt=media`), uploads (`insert`)
  and deletes (`delete`)."""
  from gcp_storage_emulator import server  # pylint: disable=g-import-not-at-top
  from gcp_storage_emulator.handlers import objects  # pylint: disable=g-import-not-at-top
  replace = {
      objects.download: _with_preconditions(objects.download, _path_name,
                                            reading=True),
      objects.insert: _with_preconditions(objects.insert, _upload_name,
                                          reading=False),
      objects.delete: _with_preconditions(objects.delete, _path_name,
                                          reading=False),
  }
  found = set()
  for _, methods in server.HANDLERS:
    for method, handler in list(methods.items()):
      if handler in replace:
        methods[method] = replace[handler]
        found.add(handler)
  if found != set(replace):
    raise RuntimeError("gcp-storage-emulator's handlers changed; update "
                       "dipaco_jax/testing/gcs_server.py (or its pinned "
                       "version)")
  # `get` (alt=media) and the router's upload fallback call these by name.
  objects.download = replace[objects.download]
  objects.insert = replace[objects.insert]


def _log_requests(log_path: str) -> None:
  """Appends each request the emulator routes to `log_path` (one JSON line,
  written whole before the response is sent)."""
  from gcp_storage_emulator import server  # pylint: disable=g-import-not-at-top
  log = open(log_path, "a", buffering=1)  # pylint: disable=consider-using-with
  handle = server.Router.handle

  def logged(router, method):
    request = router._request_handler  # pylint: disable=protected-access
    method = request.headers.get("x-http-method-override") or method
    url = urllib.parse.urlsplit(request.path)
    log.write(json.dumps({"time": time.time(), "method": method,
                          "path": url.path,
                          "query": urllib.parse.parse_qs(url.query)}) + "\n")
    return handle(router, method)

  server.Router.handle = logged


def _serve(port: int) -> None:
  _patch_emulator()
  _log_requests(os.path.join(os.getcwd(), gcs.REQUEST_LOG))
  from gcp_storage_emulator import __main__ as emulator_main  # pylint: disable=g-import-not-at-top
  emulator_main.main(["start", "--host", "127.0.0.1", "--port", str(port),
                      "--in-memory", "--quiet"])


if __name__ == "__main__":
  _serve(int(sys.argv[1]))
