"""The APIs agents speak beside chat completions: OpenAI's Responses and Anthropic's Messages. Each
request becomes a chat request (validated, templated, scheduled as chat's) and each answer the same
parsed turn in the API's own shape.
"""
