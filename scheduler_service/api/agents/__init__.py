"""The APIs agents speak: OpenAI's Responses and Anthropic's Messages, each request made a chat
request and each answer said in the API's shape.
"""
