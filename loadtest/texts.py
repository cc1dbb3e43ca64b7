"""The text the synthetic scenarios are made of: system prompts, places, subjects, words."""

SYSTEM_PROMPT = (
    "You are a travel planning assistant for a city guide service. Plan realistic itineraries "
    "from the points of interest retrieved for the user and from the conversation so far. "
    "Respect opening hours, ticket prices, walking distances and the pace the traveller asks "
    "for. Group nearby places, leave time for meals and rest, and suggest a rainy-day "
    "alternative. Answer with a short plan per day: morning, afternoon and evening, each with "
    "times, places and one practical tip. If something is unknown, say so instead of guessing. "
)

ARTICLES_SYSTEM_PROMPT = (
    "You are a staff writer for a travel and culture magazine. Write clear, well structured "
    "articles for curious readers: a title, a one-sentence summary, then three to five short "
    "sections with headings. Prefer concrete facts, dates, places and numbers over adjectives. "
    "Explain any technical term the first time it appears. Keep a friendly, neutral tone, avoid "
    "lists longer than five items, and end with a short paragraph on what to see or read next. "
    "Do not invent quotes. Write in plain English for a general audience of all ages. "
)

CITIES = (
    "Lisbon",
    "Porto",
    "Seville",
    "Lyon",
    "Bologna",
    "Krakow",
    "Ghent",
    "Valencia",
    "Edinburgh",
    "Ljubljana",
    "Tallinn",
    "Bergen",
    "Salzburg",
    "Granada",
    "Turin",
    "Riga",
)
CATEGORIES = (
    "museum",
    "castle",
    "market",
    "garden",
    "cathedral",
    "viewpoint",
    "harbour",
    "bridge",
    "old town",
    "station",
    "park",
    "gallery",
    "river walk",
    "restaurant",
)
NAMES = (
    "Royal",
    "Old",
    "Harbour",
    "River",
    "North",
    "Golden",
    "Stone",
    "Saint Mary",
    "Castle Hill",
    "Green",
    "Market Square",
    "Tower",
    "Cathedral",
    "East Gate",
)
FEATURES = (
    "free entry on Sundays",
    "step-free access",
    "a quiet reading room",
    "vegetarian food stalls",
    "a view over the river",
    "guided tours at 11:00",
    "long queues after 10:00",
    "a small cafe",
    "a rooftop terrace",
    "audio guides in six languages",
    "a playground",
    "evening concerts",
)
PREFERENCES = (
    "a slow pace",
    "vegetarian food",
    "museums",
    "walks by the river",
    "quiet places to read",
    "local markets",
    "history",
    "views at sunset",
    "travelling with two children",
    "no more than 8 km of walking a day",
)
QUESTIONS = (
    "Plan day {day} around the {poi}; we like {pref}. How far is it from the hotel?",
    "Can we swap the {poi} for something open after 18:00 on day {day}? We want {pref}.",
    "What is a good lunch stop near the {poi}, and how long should we stay there on day {day}?",
    "It will rain on day {day}. Rework the plan with indoor places near the {poi}.",
    "Add the {poi} to day {day} and tell me the ticket prices and the best time to arrive.",
    "We arrive at 09:30 on day {day}. Is the {poi} worth it if we prefer {pref}?",
)
SUBJECTS = (
    "the railway",
    "the old bridge",
    "the harbour",
    "street food",
    "city gardens",
    "public libraries",
    "night trains",
    "tram networks",
    "river ferries",
    "lighthouses",
    "covered markets",
    "mountain huts",
    "coffee houses",
    "canals",
    "bicycle lanes",
    "stone castles",
    "music festivals",
    "botanical gardens",
    "city walls",
    "cable cars",
)
ANGLES = (
    "its history",
    "how it works today",
    "the people who run it",
    "its future",
    "what visitors miss",
    "its role in the local economy",
    "the best way to see it",
    "its architecture",
    "five surprising facts about it",
    "how it changed since 1950",
)
WORDS = (
    "trip",
    "plan",
    "museum",
    "market",
    "castle",
    "river",
    "station",
    "ticket",
    "price",
    "morning",
    "evening",
    "day",
    "walk",
    "garden",
    "bridge",
    "harbour",
    "cathedral",
    "hotel",
    "restaurant",
    "vegetarian",
    "quiet",
    "read",
    "open",
    "hours",
    "distance",
    "stops",
    "minutes",
    "euros",
    "stars",
    "rating",
    "the",
    "a",
    "and",
    "with",
    "to",
    "of",
    "in",
    "for",
    "history",
    "railway",
    "old",
    "short",
    "visit",
    "place",
    "near",
    "city",
)
