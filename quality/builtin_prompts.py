"""The 200 built-in prompts of `kvroute quality --prompts builtin`: chat turns a small instruct model answers
(SmolLM2-135M-Instruct, `--model smollm2`), of the kinds people send: questions, instructions, code, arithmetic,
one-liners, a passage to read and answer about, and requests for long text. `LONG_FORM` comes last: the prompts
whose long answers the drift measure follows (quality/drift.py)."""

from __future__ import annotations

QUESTIONS = (
    "What is photosynthesis?",
    "Why is the sky blue?",
    "How do vaccines work?",
    "What causes the seasons on Earth?",
    "What is the difference between weather and climate?",
    "How does a rainbow form?",
    "What is the capital of France, and what is it known for?",
    "Who was Marie Curie?",
    "What is a black hole?",
    "Why do leaves change color in autumn?",
    "How do bees make honey?",
    "What is the water cycle?",
    "What does DNA stand for and what does it do?",
    "How does the heart pump blood?",
    "What is inflation in economics?",
    "Why do we need sleep?",
    "What is the largest ocean on Earth?",
    "How do airplanes stay in the air?",
    "What is gravity?",
    "What are the three states of matter?",
    "Why is exercise good for you?",
    "What is the Internet?",
    "How does a refrigerator keep food cold?",
    "What is a volcano?",
    "What is the difference between a virus and a bacterium?",
    "Who wrote Romeo and Juliet?",
    "What is the tallest mountain in the world?",
    "How do plants get water from their roots to their leaves?",
    "What is renewable energy?",
    "Why do cats purr?",
    "What is the moon made of?",
    "How does a compass work?",
    "What is democracy?",
    "What are the main causes of air pollution?",
    "How do earthquakes happen?",
    "What is a healthy breakfast?",
    "Why is the ocean salty?",
    "What is artificial intelligence?",
    "How do birds know where to migrate?",
    "What is the speed of light?",
    "What is a noun?",
    "How does recycling help the environment?",
    "What is the Great Wall of China?",
    "Why do we have different time zones?",
    "What is a galaxy?",
    "How does soap clean your hands?",
    "What is the function of the lungs?",
    "What are good ways to save money?",
    "Why do onions make people cry?",
    "What is the difference between a lake and a sea?",
)

INSTRUCTIONS = (
    "Give me three tips for staying focused while studying.",
    "Write a short thank-you note to a teacher.",
    "List five fruits that are high in vitamin C.",
    "Rewrite this sentence to be more formal: I wanna go to the meeting later.",
    "Summarize the story of Cinderella in two sentences.",
    "Suggest a name for a small coffee shop.",
    "Write a haiku about the ocean.",
    "Give me a simple recipe for pancakes.",
    "Describe a sunset in one paragraph.",
    "List the planets of the solar system in order.",
    "Write a polite email asking for a day off work.",
    "Give three reasons to learn a second language.",
    "Explain how to tie a shoelace step by step.",
    "Write a two-line poem about autumn.",
    "Suggest four activities for a rainy day.",
    "Correct the grammar in this sentence: She don't like apples.",
    "Make a packing list for a weekend camping trip.",
    "Write a short product description for a water bottle.",
    "Give me advice on how to prepare for a job interview.",
    "Turn this into a question: The train leaves at noon.",
    "Write a tweet announcing a new bakery opening.",
    "List three ways to reduce stress.",
    "Describe your ideal weekend in three sentences.",
    "Write a riddle and give its answer.",
    "Explain to a child what a cloud is.",
    "Give a one-sentence definition of friendship.",
    "Write a motivational quote about learning.",
    "Suggest a healthy snack for the afternoon.",
    "Write a short story opening about a lost key.",
    "List the steps to plant a tree.",
    "Explain the rules of tic-tac-toe.",
    "Write a birthday message for a friend.",
    "Give me five words that rhyme with light.",
    "Describe the taste of a lemon.",
    "Write a short dialogue between a cat and a dog.",
    "Suggest three books for someone who likes adventure stories.",
    "Explain how to make a cup of tea.",
    "Write a slogan for a recycling campaign.",
    "List four things you can do to be kind to your neighbors.",
    "Give me a tip for writing clear emails.",
)

CODE = (
    "Write a Python function that returns the sum of a list of numbers.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What does the len() function do in Python?",
    "Write a for loop in Python that prints the numbers from 1 to 10.",
    "Explain what a variable is in programming.",
    "Write a Python function that returns the largest number in a list.",
    "What is the difference between a list and a tuple in Python?",
    "Write a Python function to reverse a string.",
    "What is a function in programming?",
    "Write a JavaScript function that adds two numbers.",
    "How do you read a file in Python?",
    "Write a Python function that counts the vowels in a string.",
    "What is an if statement?",
    "Write a SQL query that selects all rows from a table named users.",
    "Explain what recursion is with a simple example.",
    "Write a Python function that computes the factorial of a number.",
    "What is a dictionary in Python?",
    "Write a Python list comprehension that squares the numbers from 0 to 9.",
    "What does HTML stand for?",
    "Write a Python function that checks if a number is even.",
    "Explain what a bug is in software.",
    "Write a while loop in Python that counts down from 5 to 1.",
    "What is the difference between == and = in Python?",
    "Write a Python function that returns the first n Fibonacci numbers.",
    "What is a class in object-oriented programming?",
    "Write a shell command that lists the files in a directory.",
    "How do you add an item to a list in Python?",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "What is an API?",
    "Fix this Python code: print('hello' + 5)",
)

MATH = (
    "What is 12 times 8?",
    "What is 144 divided by 12?",
    "What is 15 plus 27?",
    "What is 100 minus 37?",
    "If I have 3 apples and buy 5 more, how many apples do I have?",
    "What is the square root of 81?",
    "What is 25 percent of 200?",
    "What is the area of a rectangle that is 4 meters wide and 6 meters long?",
    "How many minutes are in three hours?",
    "What is 7 squared?",
    "A train travels 60 kilometers in one hour. How far does it travel in 4 hours?",
    "What is half of 90?",
    "Is 17 a prime number?",
    "What is the perimeter of a square with sides of 5 centimeters?",
    "What is 3 plus 4 times 2?",
    "How many days are in a leap year?",
    "What is 1000 divided by 8?",
    "If a shirt costs 20 dollars and is 10 percent off, what is the new price?",
    "What is the next number in the sequence 2, 4, 8, 16?",
    "What is 9 times 9?",
    "Convert 2 kilometers to meters.",
    "What is the sum of the angles in a triangle?",
    "What is 50 divided by 5, plus 3?",
    "How many sides does a hexagon have?",
    "What is 0.5 written as a fraction?",
    "What is 11 times 11?",
    "Solve for x: x + 5 = 12.",
    "What is the average of 4, 8 and 12?",
    "How many seconds are in one hour?",
    "What is 2 to the power of 5?",
)

SHORT = (
    "Hi!",
    "Hello, how are you?",
    "Thank you!",
    "Good morning.",
    "Tell me a joke.",
    "What's your name?",
    "Say something nice.",
    "Can you help me?",
    "What day comes after Monday?",
    "Name a color.",
    "What is 2 + 2?",
    "Give me a random fact.",
    "Are you a robot?",
    "Spell the word cat.",
    "What sound does a dog make?",
    "Good night!",
    "Name an animal that lives in the sea.",
    "What is the opposite of hot?",
    "Pick a number between 1 and 10.",
    "How many legs does a spider have?",
)

PASSAGES = (
    "The honeybee lives in colonies of tens of thousands. A single queen lays the eggs, while worker bees, all "
    "female, gather nectar and pollen, build wax comb, care for the young and guard the hive. Male bees, called "
    "drones, exist mainly to mate with a queen from another colony. In winter the workers cluster together and "
    "shiver their flight muscles to keep the queen warm.",
    "The city library opened a new wing last spring. It has a reading room with tall windows, a children's corner "
    "with picture books and soft chairs, and a small studio where visitors can record podcasts. The library is open "
    "from nine in the morning until eight in the evening on weekdays, and until five on Saturdays. It is closed on "
    "Sundays.",
    "Maria planted a vegetable garden in April. She grew tomatoes, carrots, beans and lettuce. The lettuce was ready "
    "first, in May. The beans followed in June, and the tomatoes ripened in August. The carrots took the longest, "
    "and she pulled the last of them in October, just before the first frost.",
    "A bicycle turns the push of the rider's legs into forward motion. The pedals turn a crank, the crank turns the "
    "front gear, and a chain carries the motion to the rear wheel. Changing gears changes how far the bicycle moves "
    "for each turn of the pedals: a low gear makes climbing hills easier, a high gear makes flat roads faster.",
    "The Amazon rainforest covers much of northern South America. It is home to millions of species of insects, "
    "plants, birds and other animals, many found nowhere else. The Amazon River, which runs through it, carries more "
    "water than any other river on Earth. Large parts of the forest have been cleared for farming and cattle.",
    "Tom wanted to run a marathon. He started by running two kilometers three times a week. Each week he added a "
    "little distance. After four months he could run twenty kilometers without stopping. On race day he finished "
    "the full forty-two kilometers in just under five hours, tired but very happy.",
    "Paper was invented in China about two thousand years ago. Early paper was made from the bark of mulberry "
    "trees, hemp and old rags, soaked, beaten into a pulp, spread on a screen and dried in the sun. The craft spread "
    "slowly along trade routes to the Middle East and then to Europe, where paper mills appeared in the twelfth "
    "century.",
)
PASSAGE_QUESTIONS = ("Summarize the text above in one sentence.", "Ask one question about the text and answer it.")

LONG_FORM = (
    "Write a long story about a young girl who finds a dragon egg in her garden.",
    "Write a detailed essay about the importance of clean water.",
    "Explain in detail how a car engine works.",
    "Write a long letter to a friend describing a trip to the mountains.",
    "Describe in detail a day in the life of a farmer.",
    "Write a long story about a robot who wants to learn to paint.",
    "Explain in detail the history of the printing press.",
    "Write a detailed guide to starting a small vegetable garden.",
    "Write a long story about two friends lost in a forest.",
    "Explain in detail why the oceans matter for life on Earth.",
    "Write a detailed description of a busy city market.",
    "Write a long story about a sailor caught in a storm.",
    "Explain in detail how computers store information.",
    "Write a detailed essay about the benefits of reading books.",
    "Write a long story about a village that wakes up to find the sun has not risen.",
    "Explain in detail how the human body fights an infection.",
)

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and clearly."


def builtin_conversations() -> list[list[dict[str, str]]]:
    """The 200 prompts as chat messages, LONG_FORM's 16 last. Every fifth short prompt carries a system message,
    so that the template's system path is rendered too."""
    singles = [*QUESTIONS, *INSTRUCTIONS, *CODE, *MATH, *SHORT]
    conversations = []
    for i, text in enumerate(singles):
        user = {"role": "user", "content": text}
        conversations.append([{"role": "system", "content": SYSTEM_PROMPT}, user] if i % 5 == 4 else [user])
    conversations.extend(
        [{"role": "user", "content": f"{passage}\n\n{question}"}]
        for passage in PASSAGES
        for question in PASSAGE_QUESTIONS
    )
    conversations.extend([{"role": "user", "content": text}] for text in LONG_FORM)
    return conversations
