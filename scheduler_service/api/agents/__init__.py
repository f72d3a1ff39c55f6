"""The APIs agents speak, served beside chat completions: OpenAI's Responses API (/v1/responses) and
Anthropic's Messages API (/v1/messages). Each request becomes a chat completion request, so it is validated,
templated and scheduled as chat's are; each answer is the same parsed turn, said in the API's own shape."""
