"""The committed prompt set of the FP8 quality benchmark: short chat requests of varied kinds."""

QUALITY_PROMPTS: list[list[dict]] = [[{"role": "user", "content": text}] for text in [
    "What is the capital of France, and what is it famous for?",
    "Explain photosynthesis to a ten-year-old in a few sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Write a short poem about the sea at night.",
    "If a train travels 60 km in 45 minutes, what is its average speed in km/h?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do vaccines train the immune system?",
    "Suggest a name for a small bakery and explain your choice.",
    "What are the main causes of the French Revolution?",
    "Translate 'Good morning, how are you?' into Spanish and German.",
    "Why is the sky blue?",
    "Write an email asking my manager for a day off next Friday.",
    "What does a hash table do, and why are lookups fast?",
    "List the planets of the solar system in order from the sun.",
]]
