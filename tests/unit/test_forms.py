"""The one multipart form parser (imgret.service.forms): its rules, and the upload form of /evaluate
sharing the checks of its JSON body."""

from __future__ import annotations

import io

import pytest
from starlette.datastructures import FormData, UploadFile

from imgret.service.forms import form_schema, parse_form
from imgret.service.request_rules import InvalidRequest
from imgret.service.schemas.evaluation import EvaluateRequest, EvaluateUpload
from imgret.service.schemas.gallery import GalleryUpload
from imgret.service.schemas.search import ImageSearchForm


def _file(name: str = "a.png") -> UploadFile:
    return UploadFile(io.BytesIO(b"bytes"), filename=name)


def _form(*items: tuple[str, str | UploadFile]) -> FormData:
    return FormData(list(items))


def test_repeated_fields_keep_their_order_and_blanks() -> None:
    upload = parse_form(_form(("images", _file()), ("labels", "b"), ("images", _file()),
                              ("labels", "a"), ("metadata", '{"x": 1}')), GalleryUpload)
    assert upload.labels == ["b", "a"] and len(upload.images) == 2
    assert upload.metadata_per_image() == [{"x": 1}, {"x": 1}]
    with pytest.raises(InvalidRequest, match=r"labels\[1\]: a label is 1 to 255"):
        parse_form(_form(("images", _file()), ("images", _file()), ("labels", "a"),
                         ("labels", "")), GalleryUpload)


def test_a_blank_single_field_is_not_sent() -> None:
    form = parse_form(_form(("image", _file()), ("k", ""), ("label", "")), ImageSearchForm)
    assert form.k is None and form.filters() is None


@pytest.mark.parametrize(("items", "message"), [
    ((("image", _file()), ("lable", "x")), "unknown form fields ['lable']"),
    ((("image", _file()), ("k", "3"), ("k", "5")), "k was sent more than once"),
    ((("image", "not a file"),), "image: send a file, not a text field"),
    ((("image", _file()), ("k", _file())), "k: send a text field, not a file"),
    ((("image", _file()), ("id", "3")), "send exactly one of `image`"),
    ((("image", _file()), ("metadata", '{"a": NaN}')), "metadata: NaN is not allowed"),
    ((("image", _file()), ("rerank", "k_reciprocal"), ("rerank_top_m", "3")),
     "rerank_top_m: a parameter of rerank=query_expansion"),
])
def test_refusals_are_one_message_naming_the_field(items, message) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_form(_form(*items), ImageSearchForm)
    assert message in str(refused.value)


def _upload(**fields: str | list[str]) -> EvaluateUpload:
    items: list[tuple[str, str | UploadFile]] = [("images", _file()), ("images", _file()),
                                                 ("labels", "a"), ("labels", "b")]
    for name, values in fields.items():
        items += [(name, value) for value in ([values] if isinstance(values, str) else values)]
    return parse_form(_form(*items), EvaluateUpload)


def test_evaluate_upload_reads_k_repeated_or_comma_separated() -> None:
    assert _upload(k="5,1").k == [1, 5]
    assert _upload(k=["10", "1, 5"]).k == [1, 5, 10]
    with pytest.raises(InvalidRequest, match="k: 'x' is not an integer"):
        _upload(k="1,x")


@pytest.mark.parametrize(("options", "phrase"), [
    ({"k": ["0"]}, "k must be between 1 and 1000"),
    ({"worst": "101"}, "less than or equal to 100"),
    ({"compare": ["v1", "v1"]}, "compare needs two different versions"),
    ({"compare": ["v1", "v2"], "model_version": "v1"},
     "compare names both versions: send it without model_version"),
    ({"rerank_k1": "5"}, "re-ranking parameters need rerank="),
])
def test_evaluate_upload_and_json_refuse_the_same_options(options, phrase) -> None:
    """The upload form runs the JSON body's checks (EvaluateOptions): both refuse alike."""
    with pytest.raises(InvalidRequest, match=phrase):
        _upload(**options)
    as_json = {name: [int(v) for v in value] if name == "k" else value
               for name, value in options.items()}
    with pytest.raises(ValueError, match=phrase):
        EvaluateRequest.model_validate({"query_set": "q", **as_json})


def test_the_form_schema_is_the_model() -> None:
    schema = form_schema(EvaluateUpload)
    assert schema["required"] == ["images", "labels"]
    assert set(schema["properties"]) == set(EvaluateUpload.model_fields)
    assert schema["properties"]["worst"]["maximum"] == 100
    assert all("default" not in field for field in schema["properties"].values())
