"""Schemathesis hooks (loaded through SCHEMATHESIS_HOOKS) for fuzzing `k3 serve`: a generated `model` string is
the served model's name about half the time, so that requests reach generation instead of stopping at the 404
for an unknown model, and a chat body's `messages` (free-form objects in the schema) is sometimes one user
message of generated text, so that chats get past the role check. Values of the wrong type are left alone:
they stay the invalid data they were made as."""
import hypothesis.strategies as st
import schemathesis

MODEL = "k3-tiny"  # the name the test serves the model under


@schemathesis.hook
def flatmap_body(context, body):
    if not (isinstance(body, dict) and isinstance(body.get("model"), str)):
        return st.just(body)
    named = {**body, "model": MODEL}
    if not isinstance(body.get("messages"), list):
        return st.sampled_from([body, named])
    one_user_turn = st.text(max_size=40).map(lambda t: {**named, "messages": [{"role": "user", "content": t}]})
    return st.one_of(st.sampled_from([body, named]), one_user_turn)


@schemathesis.hook
def flatmap_path_parameters(context, path_parameters):
    if isinstance(path_parameters, dict) and isinstance(path_parameters.get("model_id"), str):
        return st.sampled_from([path_parameters, {**path_parameters, "model_id": MODEL}])
    return st.just(path_parameters)
